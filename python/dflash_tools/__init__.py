"""The Python side of the `dflash` CLI: `dflash_tools.data` (data prepare/regenerate, the regenerate
bench), `dflash_tools.report` (run curves) and `dflash_tools.track` (run.report_to's wandb / mlflow
sidecar, started by `dflash run`). `dflash` runs them as `python -m dflash_tools.data ...`
and `python -m dflash_tools.report ...` with the Python of its venv."""
