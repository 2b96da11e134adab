"""swiftkv: the top floor over the three libraries. ``swiftkv.cli`` is the one ``swiftkv`` command table;
``swiftkv.quickstart`` is the main job (``swiftkv quickstart``), which drives swiftkv_core, swiftkv_distill and,
where installed, swiftkv_serve. The libraries never import this package."""
