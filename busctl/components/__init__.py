"""What busctl starts and how it keeps it alive: the component table, placement on hosts and devices, healing."""
