"""Reusable widgets: they show data and post messages up; screens decide what happens."""
