"""gateway: arrives with the mesh (issue 3+)."""
