"""GPU memory: the plan estimated before a run and the ledger of what each part holds during one."""
