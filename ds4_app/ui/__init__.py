"""The terminal app (Textual): ``DS4App`` with its widgets, screens, session store and bridge."""
