"""Process lifecycle: what the supervisor tells a component about this start of it (the launch environment)
and dying with the parent process. Imports no other project package."""
