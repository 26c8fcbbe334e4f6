"""The Python side of the `dflash` CLI: `dflash_tools.data` (data prepare/regenerate, the regenerate
bench) and `dflash_tools.report` (run curves). `dflash` runs them as `python -m dflash_tools.data ...`
and `python -m dflash_tools.report ...` with the Python of its venv."""
