"""A trained run: its folder and files (:mod:`.folder`), loading it on a device
(:mod:`.loading`), the logit gaps behind the margin (:mod:`.gaps`) and export (:mod:`.export`)."""
