"""One module per verb, imported when that verb runs (cli._verb); `stacks` is
fetch_traceback's with stacks=True. A verb's module imports the core, never another
verb's: what several verbs share lives in the core."""

#: seconds between GPU samples: defaults of `watch` and of `launch --follow` (here, so
#: that the CLI's option default does not import the watch verb)
GPU_INTERVAL_S = 5.0
