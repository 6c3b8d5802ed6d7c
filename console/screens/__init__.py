"""The console's screens: fleet, duck detail, chat, events."""
