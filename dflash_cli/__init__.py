"""dflash: train DFlash drafters on remote GPU hosts; see README.md."""

#: The distribution's name on PyPI (`pip install dflash-trainer`), which its version is
#: read by: PyPI's `dflash` is another project (docs/cli.md "Install"), possibly installed
#: beside this one.
DISTRIBUTION = "dflash-trainer"
