import os


def test_backup_dir():
    assert os.path.isdir("/home/user/backups")
