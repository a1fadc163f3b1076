"""Small helpers every part of the package stands on: argument checks (:mod:`.validation`),
torch.distributed (:mod:`.distributed`), mixed precision (:mod:`.precision`) and safe file
writing and checkpoint reading (:mod:`.io`)."""
