"""dflash: train DFlash drafters on remote GPU hosts; see README.md."""
