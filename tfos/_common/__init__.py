"""Pure helpers shared by every plane: ``deadline`` (the one deadline helper) and ``wire``
(authenticated framing for control frames and data-plane sessions)."""
