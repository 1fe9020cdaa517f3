"""Code every catalog version shares, under public names: listing ids (:mod:`.ids`), the text
the case generators forge (:mod:`.forge`) and the prompt and tool-message helpers of the scripted
policies (:mod:`.messages`). A version folder (``v0/``, ``v1/``, ``v2/``) imports from here, from
``envs.catalog.world`` and from the cross-version modules beside them, never another version's
private helpers."""
