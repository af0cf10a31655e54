"""What the agent and the trainer both need on a host: atomic writes and fsync
(atomic.py), a full disk said and room kept to say it (diskspace.py), a process known by
its pid and start time as /proc tells it (procfs.py), and the names both spell: a run's
checkpoints and export (checkpoint_files.py), the compile cache's folders and files
(compile_key.py), a Hugging Face hub id and the host's hub cache (hub.py), and a config's
paths checked as the trainer will find them (config_paths.py: the agent's preflight
checks them on the host, the CLI the release's own in its tree).

Neither half imports the other: both take these from here, as both take the strict
loader from dflash_schema, and the CLI takes them from here too. Shipped in every
release beside them; the agent imports it, so it holds to the agent's rules: Python 3.8,
the standard library only (a test holds it to them).
"""
