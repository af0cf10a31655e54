"""One module per verb, imported by its click command when it runs (`stacks` is
fetch_traceback's with stacks=True). Each `run` takes the session (and the run it acts
on) positionally, everything else by keyword. A verb's module imports the core, never
another verb's: what several verbs share lives in the core."""

#: seconds between GPU samples: defaults of `watch` and of `launch --follow` (here, so
#: that the CLI's option default does not import the watch verb)
GPU_INTERVAL_S = 5.0
