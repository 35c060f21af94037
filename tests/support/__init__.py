"""Test and benchmark support: lab helpers that users never run."""
