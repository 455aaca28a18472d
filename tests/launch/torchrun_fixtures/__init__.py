"""Small tier-2 modules that tests/launch/test_torchrun_harness.py launches (not collected on their
own: their names do not start with ``test_``)."""
