"""One module per verb, imported when that verb runs (cli._verb)."""

#: seconds between GPU samples: defaults of `watch` and of `launch --follow` (here, so
#: that the CLI's option default does not import the watch verb)
GPU_INTERVAL_S = 5.0
