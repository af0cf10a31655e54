"""The contract between dflash's two halves and the trainer, in one place: what the CLI
sends the agent and reads back, what the agent and the trainer write in a run's folder,
and the names both sides must spell alike.

    replies   every verb's reply, the error object, `dflash setup`'s answer
    follow    the `follow` stream's messages
    deploy    the deploy receiver's answers
    requests  the agent's verbs the CLI calls, as types that give their argv
    states    RunState: a run's state with its exit code, precedence and failure
    records   run.json, exit.json, errors.jsonl's records, the abort file, typed
    events    events.jsonl: every event type, its fields, the check the trainer makes
    names     environment variable names, limits, file names both sides use
    checker   the one strict reader every typed record and reply goes through

Standard library only, and Python 3.8's: the agent imports it from its release, the
trainer beside it, the CLI from its own tree (docs/DESIGN.md).
"""
