ESTIMATORS = {"grpo": None, "rloo": None, "opo": None, "otb": None}
SECTIONS = ("advantages",)
