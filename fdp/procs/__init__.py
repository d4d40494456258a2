"""The world of processes: launching, joining, devices, stop signals, keepers and shrinking worlds."""
