"""From the command line to one resolved run: flags, presets, the checks before any process group, sizing."""
