"""Dataset preparation behind `dflash data prepare` / `dflash data regenerate` (docs/data.md)."""
