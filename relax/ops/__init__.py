"""Operations: notifications, heartbeats, engine replacement and step traces (DESIGN.md §6)."""
