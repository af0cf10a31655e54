"""Experiment trackers fed by `watch` (docs/cli.md "Trackers"): W&B, MLflow and
trackio get every scalar TensorBoard gets, from the events mirrored here, so the hosts
need nothing new and no internet.

One `Trackers` per watch of a run (rank 0's part): its sinks open when the first
connection is made, take what the local events.jsonl holds that they lack, then each
batch as it arrives. logs/<host>/<run>/trackers.json says, per sink, the tracker run and
how far it got: the byte of events.jsonl up to which it holds everything and the last
step it holds of each kind of event. A later watch (after Ctrl-C, or the next attempt's,
after `dflash resume`) goes on in the same tracker run from there. What each holds is the
run's history as scalars.History says, the rule of every sink (TensorBoard and `plot`
too): one value per tag and step, the attempt's that continued the run; a resume that
replaces values a tracker holds has the sink rebuild its tracker run from the history,
which the local events.jsonl holds whole. Where a tracker can say what it holds
(MLflow, trackio) its own record is what counts: one that differs from the history is
rebuilt. W&B's runs hold what they were sent only once they finish (its service process
writes them): its record moves on when its run finished, and a watch that did not get
there sends the same rows again, under the numbers they had.

A sink that raises stops receiving for the rest of this watch, with one warning, and
the watch goes on; its record stays where it failed, so the next watch sends it the
rest. Each tracker's package is imported only when it is configured.
"""
