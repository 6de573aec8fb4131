import os


def test_input_is_there():
    assert os.path.isfile("/app/files/words.txt")


def test_no_output_yet():
    assert not os.path.exists("/app/count.txt")
