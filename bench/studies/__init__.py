"""One question each: the hot path, a save's phases, the scatter plan, the layout index, the export's
memory, the flat format, the launcher's start-up."""
