"""The agent's engine worker processes: their command lines, launch, records on disk, readiness and supervision."""
