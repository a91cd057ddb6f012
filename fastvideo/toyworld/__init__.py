"""Toy world: generated scenes of coloured shapes and a verifiable prompt-following reward, for testing RL of
text-to-image models on a CPU. ``scenes`` holds the world (grammar, split, renderer); ``verify`` scores an image
against its prompt by pixel analysis (colour, shape, count, relative position); ``pretrain`` trains the toy FLUX
(VAE + transformer) on the scenes, whose default weights ship in ``weights/``; ``python -m fastvideo.toyworld``
builds, pretrains, or writes the prompt splits. The toy world in time (``motion``, ``pretrain_video``: the toy Wan,
``weights_video/``) and the toy edit world (``edit_world``: instructions, ground truth and the edit verifier;
``pretrain_edit``: the toy Kontext, ``weights_edit/``) build on it. ``scenes``, ``verify`` and ``edit_world`` import
nothing heavy beyond numpy and torch."""
