"""The hand-off contracts: boundary index ↔ engine ids (convention, rules), what each engine can capture, the gate, inspect."""
