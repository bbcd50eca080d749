"""`python -m rollout_lens` is the `rollout-lens` command."""

from rollout_lens.cli import main

raise SystemExit(main())
