"""What a recipe trains: each objective a LightningModule behind one interface (``objective.Objective``: what a batch
holds, the loss and its normalisation, what is logged and evaluated), registered by name in ``registry``."""
