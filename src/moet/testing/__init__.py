"""Test helpers shipped with the package (nothing here downloads anything)."""
