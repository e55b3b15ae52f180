"""The recipe application, in rooms that point down: ``run`` (the runner, loading a recipe, the run folder, console,
stopping, checkpoints, plot, export, dry run) -> ``objectives`` (what is trained: language modelling, SFT; one
interface, one registry) -> ``data`` (text, chat and instruction rows) -> ``settings`` (the recipe schema and what it
points at) -> ``models`` (the reference model and its HF wrapper).

It uses the library the way a user does; nothing in the library imports from here.
"""
