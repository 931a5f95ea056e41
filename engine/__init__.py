"""DDTree Studio's engine, in rooms by role: ``loop``, ``models``, ``measure``, ``on_vllm``, ``gpu``,
``serving``, ``tools`` and ``training``, on ``errors`` and ``trace`` (the ``Trace`` that the app and ``viz``
read). ARCHITECTURE.md draws the floors."""
