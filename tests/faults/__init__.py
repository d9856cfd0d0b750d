"""The fault-injection matrix: one module per fault family (README, "Fault matrix";
``scripts/fault_matrix.py`` runs it and prints the table)."""
