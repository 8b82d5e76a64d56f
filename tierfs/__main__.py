from tierfs.cli import entry

entry()
