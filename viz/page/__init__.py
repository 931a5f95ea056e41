"""The page's views: one small view a part of the page (``run``, ``replay``, ``traffic``, ``traces``, ``inspector``,
``sweep``, ``doctor``), each building its components and holding its handlers, and ``state``, what they share.

Handlers return ``{component: value}``, so each updates exactly what it changes; all per-user data arrives through
``gr.State``. ``app.StudioApp`` lays the views out, wires them, and shows a set of finished traces in all of them at
once (``present``).
"""
