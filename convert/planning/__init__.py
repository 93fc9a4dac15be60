"""Plan: what a convert will write, before anything is written.

``source`` reads a checkpoint's index and headers (``roles``: each tensor's role in its model
family and its identified source format); ``plan`` turns source + recipe into files, tensors and
jobs with every shape and byte range known; ``containers`` are the output files' layouts;
``aux_files`` the source's other files that travel into the artifact. No file is written here.
"""
