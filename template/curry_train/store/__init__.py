"""What the tools persist: the run ledger and the configs/ store."""
