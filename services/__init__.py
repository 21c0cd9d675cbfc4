"""kvmesh services: one package per service; they never import each other."""
