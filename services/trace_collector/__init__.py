"""trace-collector: arrives with the mesh (issue 3+)."""
