import os


def test_export():
    assert os.path.isfile("/home/user/export.csv")
