"""The fault-injection matrix: one module per fault family (docs/faults.md;
``scripts/fault_matrix.py`` runs it and prints the table)."""
