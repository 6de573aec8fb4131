import os


def test_input_is_there():
    assert os.path.isfile("/app/files/numbers.txt"), "the setup should have created numbers.txt"
