"""The compose file run for real: a Docker engine, local stand-in images, the project."""
