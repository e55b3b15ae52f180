"""The recipe application: schema, runner, data, reference models, the LightningModule and the launcher.

It uses the library the way a user does; nothing in the library imports from here.
"""
