"""The ``moeplan`` command line: thin typer wrappers over the library, one module per group.

``app.py`` holds the typer apps, each ``<group>.py`` registers its commands on them, and
``main.py`` wires everything and maps library errors to one-line messages.
"""
