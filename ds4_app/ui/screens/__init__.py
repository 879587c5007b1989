"""Modal screens: settings, help, sessions, and a one-line input dialog."""
