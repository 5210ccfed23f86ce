"""Shared core of the web envs (``webarena``, ``miniwob``).

``actions`` (pure parser of WebArena actions), ``a11y`` (accessibility-tree observation with element ids),
``browser`` (bounded pool of Chromium contexts driven by Playwright), ``evaluators`` (WebArena's
string_match / url_match / program_html), ``env`` (the browser episode both envs build on), ``sites``
(our local shop and forum) and ``tasks`` (their WebArena-format task sets).
"""
