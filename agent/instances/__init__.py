"""The instances the agent was asked to run: its table of them, starts, state reports and ownership checks."""
