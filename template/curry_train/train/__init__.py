"""Training: the loop, the torchrun and forkserver launchers, and the jobs a rank runs."""
