"""Training curves of a dflash run directory as PNG files and one HTML page (`dflash report`)."""
